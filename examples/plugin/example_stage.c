/* A vendor backend that replaces one stage of the chunked operator: `cumsum` (SPEC.md §2, F1), the
 * chunk-local inclusive cumulative sum of the gate in log2 units, written to problem->gcum. The
 * dispatcher runs the other stages on the built-in backends in the same call (the stage pipeline).
 *
 * What it declares (gla_capability): the cumsum stage on host memory, float32 gates only, per-key
 * gates only, K up to 256, any V; varlen and every state feature; any layout; deterministic. What
 * the data cannot say is checked in verify: the pipeline's chunk size must be a multiple of 16 (a
 * stand-in for a real kernel's tiling constraint). Built against the installed package only
 * (CMakeLists.txt beside it); docs/writing-a-backend.md walks through it. */
#include <math.h>
#include <stdio.h>

#include "gla/gla.h"

GLA_PLUGIN_DEFINE_ABI_VERSION()

static const gla_capability kCapabilities[] = {{
    .unit_mask = 1ull << GLA_UNIT_CUMSUM,
    .device_mask = 1ull << GLA_DEVICE_CPU,
    .dtype_mask = (1u << GLA_DTYPE_F32) | (1u << GLA_DTYPE_F16) | (1u << GLA_DTYPE_BF16),
    .gate_dtype_mask = 1u << GLA_DTYPE_F32,
    .k_min = 1, .k_max = 256, .v_min = 1, .v_max = 0,
    .features = GLA_FEATURE_VARLEN | GLA_FEATURE_INITIAL_STATE | GLA_FEATURE_FINAL_STATE | GLA_FEATURE_STATE_V_FIRST |
                GLA_FEATURE_PER_KEY_GATE,
    .deterministic = 1,
}};

static int32_t stage_verify(void* user_data, const gla_problem* p, char* message, size_t capacity) {
  (void)user_data;
  if (p->chunk_size % 16 != 0) {
    snprintf(message, capacity, "chunk size %lld is not a multiple of 16", (long long)p->chunk_size);
    return 0;
  }
  return 1;
}

static int32_t stage_run(void* user_data, const gla_problem* p, char* message, size_t capacity) {
  (void)user_data; (void)message; (void)capacity;
  const gla_tensor* g = &p->g;
  const gla_tensor* out = &p->gcum; /* [B, T, H, K] fp32, contiguous */
  const float* gd = (const float*)g->data;
  float* od = (float*)out->data;
  for (int64_t n = 0; n < p->N; ++n) {
    /* Sequence n: batch row n, or tokens [seq_offsets[n], seq_offsets[n + 1]) of row 0 (varlen). */
    const int64_t b = p->varlen ? 0 : n;
    const int64_t start = p->varlen ? p->seq_offsets[n] : 0;
    const int64_t length = p->varlen ? p->seq_offsets[n + 1] - start : p->T;
    for (int64_t h = 0; h < p->H; ++h) {
      for (int64_t i = 0; i < p->K; ++i) {
        double acc = 0;
        for (int64_t t = 0; t < length; ++t) {
          if (t % p->chunk_size == 0) acc = 0;
          const int64_t tok = start + t;
          acc += gd[b * g->strides[0] + tok * g->strides[1] + h * g->strides[2] + i * g->strides[3]];
          od[b * out->strides[0] + tok * out->strides[1] + h * out->strides[2] + i * out->strides[3]] =
              (float)(acc / log(2.0));
        }
      }
    }
  }
  return GLA_STATUS_OK;
}

GLA_PLUGIN_EXPORT gla_status gla_plugin_register(void) {
  gla_backend_desc d = {0};
  d.abi_version = GLA_ABI_VERSION;
  d.name = "example_stage";
  d.priority = 5; /* ahead of the built-in backends: a vendor kernel is meant to be used */
  d.device_mask = kCapabilities[0].device_mask;
  d.unit_mask = kCapabilities[0].unit_mask;
  d.verify = stage_verify;
  d.run = stage_run;
  d.capabilities = kCapabilities;
  d.capability_count = 1;
  return gla_register_backend(&d);
}

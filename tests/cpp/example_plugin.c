/* An out-of-tree backend as a vendor would ship it: plain C, a shared library exporting
 * gla_plugin_register, built against gla.h only. It serves host memory, implements the whole
 * forward, declines problems with K > 64 (with a reason), and runs by delegating to `reference`
 * through the public API. Loaded by tests/cpp/test_plugins.cpp. */
#include <stdio.h>

#include "gla/gla.h"

static int32_t example_verify(void* user_data, const gla_problem* p, char* message, size_t capacity) {
  (void)user_data;
  if (p->K > 64) {
    snprintf(message, capacity, "K=%lld > 64 supported by the example plugin", (long long)p->K);
    return 0;
  }
  return 1;
}

static const gla_tensor* optional(const gla_tensor* t) { return (t->data || t->rank) ? t : NULL; }

static int32_t example_run(void* user_data, const gla_problem* p, char* message, size_t capacity) {
  (void)user_data;
  gla_chunk_forward_args a = {&p->q, &p->k, &p->v, &p->g, optional(&p->initial_state), optional(&p->cu_seqlens),
                              NULL, &p->o, optional(&p->final_state)};
  gla_options o;
  gla_options_init(&o);
  o.backend = "reference";
  o.has_scale = 1;
  o.scale = p->scale;
  o.state_v_first = p->state_v_first;
  gla_status s = gla_chunk_forward(&a, &o);
  if (s != GLA_STATUS_OK) snprintf(message, capacity, "%s", gla_last_error());
  return s;
}

GLA_PLUGIN_DEFINE_ABI_VERSION()

GLA_PLUGIN_EXPORT gla_status gla_plugin_register(void) {
  gla_backend_desc d = {0};
  d.abi_version = GLA_ABI_VERSION;
  d.name = "example_plugin";
  d.priority = 2000; /* after everything: runs only when asked for */
  d.device_mask = 1ull << GLA_DEVICE_CPU;
  d.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
  d.verify = example_verify;
  d.run = example_run;
  return gla_register_backend(&d);
}

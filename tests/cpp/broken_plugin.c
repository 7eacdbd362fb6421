/* Plug-ins that must be refused, one per BROKEN value (tests/cpp/test_plugins.cpp):
 *   1  built for an ABI version this libgla does not read
 *   2  no gla_plugin_abi_version symbol (an old or hand-made plug-in)
 *   3  registers one backend, then fails its registration */
#include "gla/gla.h"

#if BROKEN == 1
GLA_PLUGIN_EXPORT uint32_t gla_plugin_abi_version(void) { return GLA_ABI_VERSION + 7; }
#elif BROKEN == 3
GLA_PLUGIN_DEFINE_ABI_VERSION()
#endif

static int32_t never_run(void* user_data, const gla_problem* p, char* message, size_t capacity) {
  (void)user_data; (void)p; (void)message; (void)capacity;
  return GLA_STATUS_INTERNAL_ERROR;
}

GLA_PLUGIN_EXPORT gla_status gla_plugin_register(void) {
  gla_backend_desc d = {0};
  d.abi_version = GLA_ABI_VERSION;
  d.name = "broken_half_registered";
  d.priority = 1;
  d.device_mask = 1ull << GLA_DEVICE_CPU;
  d.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
  d.run = never_run;
  gla_status s = gla_register_backend(&d);
  if (s != GLA_STATUS_OK) return s;
  d.name = NULL; /* the second backend's table is bad: registration fails */
  return gla_register_backend(&d);
}

// Reports the right ABI version but exports no blade_engine_run.
#include "blade_abi.h"

extern "C" int32_t blade_engine_abi_version(void) { return BLADE_ABI_VERSION; }

// blade._C, the Python face of the runtime. Importing it also registers torch.classes.blade.Engine
// (engine_registration.cpp is linked into this extension).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "archive_check.h"
#include "blade_abi.h"
#include "frozen_tensors.h"
#include "isa.h"
#include "oversubscription.h"
#include "python_engine_call.h"
#include "python_testing.h"
#include "runtime.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "blade runtime: the Engine custom class, the engine ABI and host checks";
  m.def("abi_version", [] { return BLADE_ABI_VERSION; },
        "The runtime ABI version (BLADE_ABI_VERSION) engines must be compiled against.");
  m.def("host_isa", &blade::host_isa,
        "The highest x86-64 level (x86-64, x86-64-v2, -v3, -v4) this CPU supports.");
  m.def("isa_supported", &blade::isa_supported, pybind11::arg("isa"),
        "Whether code compiled with -march=<isa> runs on this CPU (False for unknown names).");
  m.def("known_isas", &blade::known_isas, "The ISA levels blade knows, lowest first.");
  blade::bind_frozen_tensors(m);
  blade::bind_engine_call(m);
  m.def("verify_archive", &blade::verify_archive, pybind11::arg("path"),
        "Checks an exported archive's records against the SHA-256s in extra/blade_records.txt; "
        "RuntimeError naming the first record that differs.");

  m.def("thread_stalls", &blade::stall_count,
        "How many parallel regions of the runtime waited milliseconds for a thread without a core "
        "(another process held it); after each, engine calls ran on one thread for a while.");

  m.def("gemm_choices", [] {
    pybind11::list rows;
    for (const blade::GemmChoice& choice : blade::gemm_choices()) {
      pybind11::dict row;
      row["shape"] = choice.shape;
      row["kernel"] = choice.kernel;
      row["microseconds"] = choice.microseconds;
      row["timings"] = choice.timings;
      row["settled"] = choice.settled;
      rows.append(row);
    }
    return rows;
  }, "The GEMM kernel the runtime chose per call shape in this process (BLADE_GEMM), with each timed "
     "candidate's best call in microseconds; 'settled' False while its calls still sample the candidates.");

  auto testing = m.def_submodule("_testing", "Hooks into the runtime for blade's own tests.");
  blade::bind_testing(testing);
}

// The Python module `fastcredit._C`. Ops register themselves with TORCH_LIBRARY_FRAGMENT in
// their own files and are called as torch.ops.fastcredit.<op>; importing this module is
// what runs those registrations.
#include <Python.h>

namespace {

PyModuleDef fastcredit_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "fastcredit CUDA ops; call them through torch.ops.fastcredit (see fastcredit/retrieval/ops.py).",
    -1,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&fastcredit_c_module); }

// Python module entry point of fastprompt._C. The ops themselves register with the dispatcher
// (TORCH_LIBRARY_FRAGMENT(fastprompt, ...)) when the shared library is loaded; importing the module is
// what loads it. Only compiled by torch.utils.cpp_extension (which defines TORCH_EXTENSION_NAME): the
// CMake build makes a plain shared library for torch.ops.load_library and needs no Python module.
#ifdef TORCH_EXTENSION_NAME
#include <Python.h>

#define FASTPROMPT_CONCAT_(a, b) a##b
#define FASTPROMPT_CONCAT(a, b) FASTPROMPT_CONCAT_(a, b)

static struct PyModuleDef fastprompt_module = {
    PyModuleDef_HEAD_INIT, "_C",
    "fastprompt C++ CPU kernels; the ops are torch.ops.fastprompt.* (registered on import)", -1, nullptr};

PyMODINIT_FUNC FASTPROMPT_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&fastprompt_module); }
#endif

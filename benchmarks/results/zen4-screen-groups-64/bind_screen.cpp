#include <torch/extension.h>
#include "screen_linear.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("q4_screen_linear_out", &q4_screen_linear_out); }

#include <torch/extension.h>
#include "w8a8_linear.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a8_linear_out", &w8a8_linear_out, py::arg("out"), py::arg("x"), py::arg("wp"), py::arg("affine"), py::arg("bias") = py::none(), py::arg("largest_codes") = py::none());
  m.def("w8a8_activations", &w8a8_activations);
}

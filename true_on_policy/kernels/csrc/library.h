// Each source of the library registers its own functions on the one module (fixed_order.cpp's
// PYBIND11_MODULE calls these).
#pragma once
#include <torch/extension.h>

void register_norms(pybind11::module& m);
void register_activation(pybind11::module& m);
void register_linear(pybind11::module& m);
void register_moe(pybind11::module& m);
void register_attention(pybind11::module& m);
void register_gated_delta(pybind11::module& m);
void register_gated_delta_layer(pybind11::module& m);

// The pieces gptkit's CPU products and its fused decode step are made of: the vector layer (simd.h), the quantised
// weight formats and rounded activations (quant.h) and the products over them (row_products.h, products.h).
#pragma once

#include "products.h"

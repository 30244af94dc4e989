// The pieces gptkit's CPU products and its fused decode step are made of: the vector layer (simd.h), the quantised
// weight formats and rounded activations (quant.h), the few-row products over them (row_products.h, products.h) and
// the many-row fp32 product (gemm.h).
#pragma once

#include "gemm.h"
#include "products.h"

"""Layer 2, low precision below the model: recipes (which operand of which matmul goes to which
format), the quantized linear layer that applies a recipe and the convergence runner
(`quantized`), and format error figures (`numerics`)."""

"""The layers qcheck builds per recipe: the MoE (:mod:`.moe`), the decoder stack (:mod:`.decoder`), the
quantized call site every matmul goes through (:mod:`.bridge`), and the train step (:mod:`.step`)."""

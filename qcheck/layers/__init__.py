"""The layers qcheck builds per recipe: the MoE (:mod:`.moe`), the decoder stack (:mod:`.decoder`), the
quantized call site every matmul goes through (:mod:`.bridge`), the train step (:mod:`.step`) and the
reference trainer (:mod:`.trainer`)."""

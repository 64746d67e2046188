"""The server's side of a round: screening and averaging of uploads (:mod:`.uploads`), robust
aggregators (:mod:`.robust`), server optimisers (:mod:`.server_optimizers`), K-means of client
models (:mod:`.clustering`) and similarity distillation on public images (:mod:`.similarity`)."""

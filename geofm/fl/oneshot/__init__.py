"""One-shot federated classification: FedDiff (:mod:`.feddiff`, with Fourier magnitude filtering,
:mod:`.fmf`), OSCAR (:mod:`.oscar`), their resumable synthetic split (:mod:`.synthetic`) and
ensemble distillation (:mod:`.ensemble`)."""

"""Which client holds what: pretraining files of the sources (:mod:`.files`) and samples of a labelled
finetuning split, the decentralisation scenarios (:mod:`.samples`)."""

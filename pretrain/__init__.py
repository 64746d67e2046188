"""Central pretraining: ``geofm pretrain`` of any registered objective (:mod:`geofm.tasks`) on the DeepSpeed engine."""

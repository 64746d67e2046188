"""The finetuning program: ``geofm finetune``, evaluation, reports, prediction and ONNX export; the tasks,
their model, losses and metrics live in :mod:`geofm.tasks.finetuning`."""

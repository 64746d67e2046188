"""The pretraining objectives, each a task of :data:`geofm.tasks.TASKS`."""

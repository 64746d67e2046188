"""DINO self-distillation: the task, the student and EMA teacher, the loss and schedules, the multi-crop views."""

"""The objectives' tests run the pretraining and finetuning programs' tiny setups."""

from tests.finetune.conftest import class_folders  # noqa: F401
from tests.pretrain.conftest import killed_then_resumed, tiny_tree, wait_for, write_config  # noqa: F401

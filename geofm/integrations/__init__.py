"""geofm models inside other frameworks' training loops (:mod:`.terratorch`: TerraTorch backbones).

Each module imports only what its framework's own environment has (torch, timm, safetensors,
pydantic, PyYAML), never geofm's training stack (DeepSpeed, Flower, rasterio), so it installs
next to the framework with ``pip install --no-deps geofm``.
"""

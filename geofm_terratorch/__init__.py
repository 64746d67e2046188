"""TerraTorch's custom module for geofm: importing it registers the ``geofm_export`` backbone.

TerraTorch imports the folder named by ``custom_modules_path`` as a package, after putting the
folder's parent first on ``sys.path``. This folder's parent is the one holding ``geofm`` itself
(the repository, or ``site-packages`` after ``pip install``), so nothing else becomes importable.
Point a config at it (``custom_modules_path: geofm_terratorch`` from the repository root), or print
its path with ``python -c "import geofm_terratorch; print(geofm_terratorch.PATH)"``. See
:mod:`geofm.integrations.terratorch`.
"""

from pathlib import Path

from geofm.integrations.terratorch import register

PATH = Path(__file__).resolve().parent
"""This folder: the value of TerraTorch's ``custom_modules_path``."""

register()

"""The configs ``launch.train --config=configs/<name>.py`` reads.

Installed with rljax (``pip install -e .`` or from a wheel), so that
``from configs import arithmetic_grpo`` works from any directory, e.g. in a
notebook: ``arithmetic_grpo.get_config("tiny")``. ``path(name)`` gives a
config file's path for ``--config=`` from outside the repository.
"""

import os


def path(name: str) -> str:
  """The file of config ``name`` (``"arithmetic_grpo"`` or its file name).

  Raises:
    FileNotFoundError: naming the configs there are.
  """
  stem = name.removesuffix(".py")
  file = os.path.join(os.path.dirname(__file__), stem + ".py")
  if stem.startswith("_") or not os.path.isfile(file):
    names = sorted(n.removesuffix(".py") for n in os.listdir(
        os.path.dirname(__file__)) if n.endswith(".py") and not n.startswith("_")
        and n != "common.py")
    raise FileNotFoundError(f"no config {name!r}; there are {names}.")
  return file

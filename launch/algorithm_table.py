"""Writes the algorithm tables of docs/guides/algorithms.md from
``rljax/train/table.py``.

  python -m launch.algorithm_table          # print them
  python -m launch.algorithm_table --write  # replace them in the guide

The guide holds them between the markers ``<!-- algorithm-table -->`` and
``<!-- /algorithm-table -->``; ``tests/test_algorithm.py`` fails when they
differ from the table.
"""

import pathlib

from absl import app, flags

from rljax.train import table

_WRITE = flags.DEFINE_bool("write", False, "replace the tables in the guide")
START, END = "<!-- algorithm-table -->", "<!-- /algorithm-table -->"
GUIDE = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides"
         / "algorithms.md")


def with_tables(readme: str) -> str:
  """``readme`` with the text between the markers replaced by the tables."""
  head, _, rest = readme.partition(START)
  _, _, tail = rest.partition(END)
  return f"{head}{START}\n{table.markdown()}{END}{tail}"


def main(argv):
  del argv
  if _WRITE.value:
    GUIDE.write_text(with_tables(GUIDE.read_text()))
  else:
    print(table.markdown())


if __name__ == "__main__":
  app.run(main)

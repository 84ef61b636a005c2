r"""Writes a dataset file you already have as an rljax JSONL task.

Each output line is ``{"prompt": ..., "answer": ...}``, the file that
``task.path`` / ``task.heldout_path`` name. The input is a local .parquet
(a Hugging Face hub file), .jsonl or .json file; nothing is downloaded.
GSM8K (``--format=gsm8k``: its ``question``, and the final answer after
``####`` of its ``answer``; each prompt asks for the answer after ``####``):

  python -m launch.prepare_data --format=gsm8k \
      --input=gsm8k/main/train-00000-of-00001.parquet \
      --output=data/gsm8k/train.jsonl

Any other dataset, by its field names:

  python -m launch.prepare_data --input=problems.jsonl \
      --output=data/problems/train.jsonl \
      --prompt_field=problem --answer_field=final_answer
"""

from absl import flags

from launch import cli

_INPUT = flags.DEFINE_string("input", None, "the dataset file: .parquet, "
                             ".jsonl or .json (a list of objects)")
_OUTPUT = flags.DEFINE_string("output", None, "the JSONL task file to write")
_FORMAT = flags.DEFINE_string("format", "", "a known dataset's fields and "
                              "answer format: 'gsm8k' ('': the fields below)")
_PROMPT_FIELD = flags.DEFINE_string(
    "prompt_field", None, "the field that becomes the prompt (default: the "
    "format's, else 'prompt')")
_ANSWER_FIELD = flags.DEFINE_string(
    "answer_field", None, "the field that becomes the answer (default: the "
    "format's, else 'answer')")
_INSTRUCTION = flags.DEFINE_string(
    "instruction", None, "text appended to each prompt after a space "
    "(default: the format's, else none)")
flags.mark_flags_as_required(["input", "output"])


def main(argv):
  del argv
  from rljax import data  # pylint: disable=import-outside-toplevel
  count = data.prepare_jsonl(
      _INPUT.value, _OUTPUT.value, preset=_FORMAT.value,
      prompt_field=_PROMPT_FIELD.value, answer_field=_ANSWER_FIELD.value,
      instruction=_INSTRUCTION.value)
  print(f"wrote {count} examples to {_OUTPUT.value}")


if __name__ == "__main__":
  cli.run(main)

"""The command-line tools beside the library: each is `python -m fastattn.tools.NAME` (and an entry
point in pyproject.toml's [project.scripts]), depends on library modules, and is imported by none.

- info: what this installation runs: versions, the build, the CPU level, the dispatch table
  (fastattn-info);
- gpu_check: one CUDA GPU's self-check and benchmark, or its dry run on the CPU
  (fastattn-gpu-check); gpu_bench: its speed stages and the state of a run;
- evaluate: the BLEU of a translation file, as fastattn.bleu scores it (fastattn-evaluate);
- average: the average of a run's last checkpoints (fastattn-average);
- ctranslate2_convert: a checkpoint as a CTranslate2 model, to benchmark decoding against
  (fastattn-ctranslate2-convert).

This package's __init__ imports nothing: `python -m fastattn.tools.info` loads only what info needs.
"""

"""Deployment targets: checkpoints other runtimes load as they are (DESIGN §10).

- `to_deepseek_v3`: an exact `DeepseekV3ForCausalLM` checkpoint for stock transformers
  (`--target transformers`), built in memory from the source GQA weights.
"""

from convert.targets.deepseek import to_deepseek_v3

__all__ = ["to_deepseek_v3"]

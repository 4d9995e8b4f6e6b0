"""Where a model's weights come from (a checkpoint directory, a synthetic generator) and how
they reach the backend and the CPU experts (streaming placement)."""

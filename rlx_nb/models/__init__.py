"""Models to try rlx_nb on: the embedded demo models and real Hugging Face architectures from small configs."""

"""Text from a fine-tuned model folder, as a user loads it with no further step (docs/language-models.md):

    python examples/generate_text.py checkpoints/lm/best-hf "the quick"

The folder is what --export-on-end hf wrote: the model's save_pretrained files and the run's tokenizer.
Needs the [hf] extra: pip install -e '.[hf]'.
"""

from __future__ import annotations

import sys


def generate(folder: str, prompt: str, new_tokens: int = 12) -> str:
    """`prompt` and the `new_tokens` the model finds most likely after it, one at a time (greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer(prompt, return_tensors="pt")
    ids = model.generate(
        **inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    return tokenizer.decode(ids[0], skip_special_tokens=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/generate_text.py FOLDER PROMPT")
    print(generate(sys.argv[1], sys.argv[2]))

"""Random PEFT LoRA adapters for a small Hugging Face model, written with save_pretrained,
and the reference each is checked against: the base model with the adapter merged."""

from __future__ import annotations

# name -> (rank, alpha, target modules, use_rslora): ranks, targets and scalings differ.
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], True),
    "mlp2": (2, 4, ["k_proj", "o_proj", "gate_proj", "down_proj"], False),
}


def make_adapter(base_dir: str, out_dir: str, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> None:
    """Writes a PEFT adapter of the model in base_dir with non-zero random A and B."""
    import peft
    import torch
    import transformers as tf

    base = tf.AutoModelForCausalLM.from_pretrained(base_dir)
    conf = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                           use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(base, conf)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: the adapter would add nothing
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir, safe_serialization=True)


def merged_model(base_dir: str, adapter_dir: str):
    """transformers' model of base_dir with the adapter merged in (peft merge_and_unload)."""
    import peft
    import transformers as tf

    base = tf.AutoModelForCausalLM.from_pretrained(base_dir)
    return peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def base_model(base_dir: str):
    """transformers' model of base_dir, as merged_model reads it (no adapter)."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(base_dir).eval()

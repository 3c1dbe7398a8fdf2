"""The engine tests' reference: greedy tokens from a plain transformers model."""


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens from a plain transformers model, one full forward per token (no cache): the reference."""
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]

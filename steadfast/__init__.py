"""steadfast: fault-tolerant distributed PyTorch training (see README)."""

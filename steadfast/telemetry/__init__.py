"""What a person sees of a run:

metrics   Telemetry: the loss and memory of every rank in metrics.jsonl, the progress display,
          TensorBoard, the memory guard (_stragglers: the rank that makes the others wait;
          _progress: rank 0's progress display)
records   RunRecord: rank 0's metrics.jsonl and events
logs      setup_logging: every rank's logs/rank<r>.log, rank 0's console
"""

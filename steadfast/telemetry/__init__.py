"""What a person sees of a run:

metrics      Telemetry: the loss and memory of every rank in metrics.jsonl, the progress display,
             the memory guard (_stragglers: the rank that makes the others wait; _progress: rank
             0's progress display)
sinks        logger.sinks: where the rows go besides metrics.jsonl (_sink: the interface;
             _tensorboard, _csv, _mlflow: TensorBoard, metrics.csv, an MLflow run)
mlflow_run   which MLflow run a run folder logs to (mlflow_run.json), without importing mlflow
records      RunRecord: rank 0's metrics.jsonl and events (_rows: the rows' own thread)
logs         setup_logging: every rank's logs/rank<r>.log, rank 0's console
"""

"""Operations: metrics, logs, status, progress, TensorBoard, plots, data preparation."""

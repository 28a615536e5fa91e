"""The thin FastAPI app: schemas, validation, decoding, error mapping, metrics."""

"""What every dialect's routes use: JSON bodies, streaming, pagination, the OpenAI-shaped log-probabilities and
error bodies, request validation errors."""

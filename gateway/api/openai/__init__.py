"""OpenAI's API: chat and text completions (their request models and routes), the model list,
embeddings, the Responses API."""

"""Tool calling: tools rendered into the prompt (by the model's chat template, or a Hermes-style fallback), the
model's output parsed into OpenAI tool calls by a parser for its family, and `required` / a named function
enforced with a grammar so the call is always valid JSON for the function's parameters."""

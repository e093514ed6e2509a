"""OpenAI's Responses API (``/v1/responses``) over the chat-completions path: ``protocol`` (the request and its
translation into a chat body), ``output`` (output items and stream events), ``store`` (kept responses), ``route``."""

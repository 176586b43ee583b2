"""The client APIs that are not the engines' own, translated to and from chat completions: OpenAI's Responses
(``responses``) and Anthropic's Messages (``anthropic``). Pure: bodies and events in, bodies and events out."""

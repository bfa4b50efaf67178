"""Multi-turn, tool-using episodes: the chat-template token layer (``chat``), environments and their tools
(``tools``), the sandbox for code (``sandbox``) and the agent that runs the turns (``agent``)."""

"""rlcore-agent-tools: multi-turn, tool-using episodes. The chat-template token layer (``chat``), environments' tools
and the tool-call parser (``tools``, ``hermes``), the process jail for code (``jail``, ``jail_setup``) and the
``python`` environment on it (``python_env``), verl's tool configs (``verl_tools``), the agent that runs the turns
(``agent``), its extension points (``hookspecs``: environments, tool parsers) and the plugin (``plugin``)."""

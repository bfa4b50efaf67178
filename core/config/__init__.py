from rlcore.config.loader import bind_plugin_section, help_text, load_config, to_dict  # noqa: F401
from rlcore.config.schema import Config  # noqa: F401

from rlcore.config.loader import (bind_plugin_section, check_runnable_here, help_text, load_config,  # noqa: F401
                                  config_from_dict, save_config, to_dict)
from rlcore.config.schema import Config  # noqa: F401

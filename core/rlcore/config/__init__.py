from rlcore.config.loader import (bind_agent, bind_plugin_section, check_runnable_here, help_text,  # noqa: F401
                                  load_config, config_from_dict, reward_model_world, save_config, to_dict)
from rlcore.config.schema import Config  # noqa: F401

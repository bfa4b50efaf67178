from rlcore.config.checks import check_runnable_here, reward_model_world  # noqa: F401
from rlcore.config.loader import (bind_agent, bind_plugin_section, help_text, load_config,  # noqa: F401
                                  config_from_dict, save_config, to_dict)
from rlcore.config.schema import Config  # noqa: F401

"""Options that several commands share."""


def add_base_option(parser) -> None:
    parser.add_argument(
        "--base",
        help="for a PEFT adapter MODEL: its base model (default: base_model_name_or_path of adapter_config.json)",
    )

"""CPU workers that speak SGLang's PD protocol (see ``python -m engine.sim --help``)."""

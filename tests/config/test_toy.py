"""The toy world's settings: each number's range beside its field, the rules between them in one function that the
generator and the training config's checks both call."""
import pytest

from fastcredit.config import ConfigError, ToyWorldConfig, load_config
from fastcredit.config.toy import check_toy_world
from fastcredit.data import toyworld

SMALL = dict(num_people=40, num_cities=20, num_countries=6, num_universities=10, num_companies=10, num_bands=10,
             num_questions=20)
BAD = [  # (settings, the message after "<name>: ")
    (dict(max_hops=4), r"max_hops must lie in \[1, 3\], got 4"),
    (dict(num_countries=0), r"num_countries must lie in \[1, inf\), got 0"),
    (dict(num_people=-1), r"num_people must lie in \[0, inf\), got -1"),
    (dict(twin_fraction=1.5), r"twin_fraction must lie in \[0, 1\], got 1.5"),
    (dict(test_fraction=float("nan")), r"test_fraction must lie in \[0, 1\), got nan"),
    (dict(min_hops=3, max_hops=2), r"min_hops must be in \[1, max_hops = 2\], got 3"),
    (dict(num_cities=3), r"num_cities \(3\) must be at least num_countries \(6\)"),
    (dict(num_universities=0), "people study somewhere: num_universities must be at least 1"),
    (dict(num_people=0), "companies and bands need people: num_people must be at least 1"),
]


@pytest.mark.parametrize("settings, message", BAD)
def test_bad_settings_are_refused_with_the_sections_name(settings, message):
    cfg = ToyWorldConfig(**{**SMALL, **settings})
    with pytest.raises(ConfigError, match=f"^toy world: {message}"):
        check_toy_world(cfg)
    with pytest.raises(ConfigError, match=f"^data.toy: {message}"):
        check_toy_world(cfg, "data.toy")
    with pytest.raises(ValueError, match=f"^toy world: {message}"):  # the generator calls the same function
        toyworld.generate_world(cfg)


@pytest.mark.parametrize("settings, message", BAD[-3:])
def test_the_training_config_applies_the_rules_between_keys(settings, message):
    overrides = [f"data.toy.{k}={v}" for k, v in {**SMALL, **settings}.items()]
    with pytest.raises(ConfigError, match=f"^data.toy: {message}"):
        load_config(None, overrides)


def test_the_generator_checks_through_the_config_function(monkeypatch):
    seen = []
    monkeypatch.setattr(toyworld, "check_toy_world", lambda cfg: seen.append(cfg) or check_toy_world(cfg))
    cfg = ToyWorldConfig(**SMALL)
    check_toy_world(cfg)  # a good config passes
    assert toyworld.generate_world(cfg).config == cfg and seen == [cfg]

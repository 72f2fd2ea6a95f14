"""The stderr operational log: ``YYYY-MM-DD HH:MM:SS.mmm LEVEL message``, no terminal control sequences."""

from __future__ import annotations

import logging
import sys
import time

LOGGER_NAME = "ninfer"
TRACE = 5
LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 10,
}
logging.addLevelName(TRACE, "TRACE")


class OperationalFormatter(logging.Formatter):
    """Local wall time with milliseconds, the level name, the message; nothing else."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        return f"{stamp}.{int(record.msecs):03d} {record.levelname} {record.getMessage()}"


def configure(level: str = "info", stream=None) -> logging.Logger:
    """Route the ``ninfer`` logger to stderr (or ``stream``) at ``level``; idempotent."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(OperationalFormatter())
    logger.addHandler(handler)
    logger.setLevel(LEVELS[level])
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)

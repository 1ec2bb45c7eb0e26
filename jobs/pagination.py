"""Query parameters read strictly: the API's pagination and one-value parameters.

Its own module, free of rest_framework.generics: DRF imports DEFAULT_PAGINATION_CLASS
while defining GenericAPIView, so this cannot live in jobs/api.py.
"""
from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination


def query_value(request: Any, name: str) -> str:
    """One query parameter: given twice it is a 400 naming it (which one would count?)."""
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise ValidationError({name: [f"give {name} once, not {len(values)} times"]})
    return values[0] if values else ""


class StrictPageNumberPagination(PageNumberPagination):
    """DRF's, but `?page=` must be a whole number from 1 if given (a 400 naming `page`,
    where DRF would quietly serve page 1); past the last page is DRF's 404. The
    project's DEFAULT_PAGINATION_CLASS."""

    last_page_strings = ()  # DRF's "last" is not in the schema: a page is a number

    def get_page_number(self, request: Any, paginator: Any) -> Any:
        value = query_value(request, self.page_query_param)
        if self.page_query_param not in request.query_params:
            return 1
        if not (value.isascii() and value.isdigit() and len(value) <= 9 and int(value) >= 1):
            raise ValidationError({"page": [f"must be a whole number from 1, not {value[:50]!r}"]})
        return value

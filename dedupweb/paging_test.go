package dedupweb_test

import "regexp"

// linkedKeys are the lock keys a list page links to.
func linkedKeys(body string) []string {
	var keys []string
	for _, m := range regexp.MustCompile(`<a class="mono" href="[^"]*">([^<]+)</a>`).FindAllStringSubmatch(body, -1) {
		keys = append(keys, unescape(m[1]))
	}
	return keys
}

// nextLink is a list page's Next link, "" on the last page.
func nextLink(body string) string {
	m := regexp.MustCompile(`<a id="next" href="([^"]+)">`).FindStringSubmatch(body)
	if m == nil {
		return ""
	}
	return m[1]
}

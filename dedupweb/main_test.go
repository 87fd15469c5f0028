package dedupweb_test

import (
	"io"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/asynq-dedup/dedup/internal/redistest"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m, "dedupweb")) }

// noRedirect is a client that shows redirects instead of following them.
var noRedirect = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

// get fetches a URL and returns the status and body.
func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	return send(t, c, req)
}

// post submits a form and returns the status and body.
func post(t *testing.T, u string, form url.Values, header http.Header) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range header {
		req.Header[k] = v
	}
	return send(t, http.DefaultClient, req)
}

// send sends a request and returns the status and body.
func send(t *testing.T, c *http.Client, req *http.Request) (int, string) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// hidden reads the hidden inputs of a page's form: name → values.
func hidden(body string) url.Values {
	v := url.Values{}
	re := regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`)
	for _, m := range re.FindAllStringSubmatch(body, -1) {
		v.Add(m[1], unescape(m[2]))
	}
	return v
}

// unescape undoes html/template's escaping of an attribute value.
func unescape(s string) string {
	return strings.NewReplacer("&#43;", "+", "&#34;", `"`, "&#39;", "'", "&lt;", "<", "&gt;", ">", "&amp;", "&").Replace(s)
}

// cell returns the text of the overview's count for a queue, type and
// state (data attributes on the row and cell).
func cell(t *testing.T, body, queue, typ, state string) string {
	t.Helper()
	row := regexp.MustCompile(`(?s)<tr data-queue="` + regexp.QuoteMeta(queue) + `" data-type="` + regexp.QuoteMeta(typ) + `">(.*?)</tr>`).FindStringSubmatch(body)
	if row == nil {
		t.Fatalf("overview has no row for %s / %s:\n%s", queue, typ, body)
	}
	m := regexp.MustCompile(`<td class="n" data-state="` + state + `">(?:<a [^>]*>)?(\d+)`).FindStringSubmatch(row[1])
	if m == nil {
		t.Fatalf("row %s / %s has no %s cell: %s", queue, typ, state, row[1])
	}
	return m[1]
}
